# BEFORE = a checkout of 107742d (before the general data path) at /work/wt-before; run from the repository root:
#   flock /tmp/distsgd-bench.lock bash bench/results/data_path_ab.sh
set -e
cd /work/main
echo "== load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in 1 2 3; do
  echo "== round $round before (107742d, builtin tensor path) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=/work/wt-before python3 bench/data_path.py --samples 6400 --repeats 1 --variants builtin | grep "^| builtin"
  echo "== round $round after (this tree, all paths) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=/work/main python3 bench/data_path.py --samples 6400 --repeats 1 | grep "^|"
done
