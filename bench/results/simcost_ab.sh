# BEFORE=<checkout of 501b9b1> AFTER=<checkout of this tree> bash bench/results/simcost_ab.sh
set -e
for round in 1 2; do
  for v in before after; do
    if [ $v = before ]; then d="$BEFORE"; else d="$AFTER"; fi
    echo "== round $round $v load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $d && PYTHONPATH=$d python3 bench/sim_cost.py --samples 6000 --repeats 1 --threads 2 2>&1 | grep -E "^\|" )
  done
done
