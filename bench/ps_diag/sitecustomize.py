# Diagnostic hook (scratch, not part of distsgd): timestamps of the phases of a push.
import json
import os
import threading
import time

if os.environ.get("FIDHOOK") and "RANK" in os.environ:
    _f = open(
        f"{os.environ['FIDHOOK']}/rank{os.environ['RANK']}-{os.getpid()}.jsonl", "a", buffering=1
    )

    def _wrapf(mod, name, tag):
        orig = getattr(mod, name)

        def wrapped(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            r = orig(*a, **k)
            import torch

            size = a[0].numel() if a and hasattr(a[0], "numel") else 0
            _f.write(
                json.dumps(
                    [
                        tag,
                        t0,
                        time.perf_counter(),
                        time.thread_time() - c0,
                        threading.current_thread().name,
                        size,
                        torch.get_num_threads(),
                    ]
                )
                + "\n"
            )
            return r

        setattr(mod, name, wrapped)

    import importlib.abc
    import sys

    def _install():
        import distsgd.engine as e
        import distsgd.runtime.dist as d
        import distsgd.runtime.ps.learner as l
        import distsgd.runtime.ps.server as s
        import distsgd.runtime.ps.transport as t

        _wrapf(e.GradientEngine, "gradient", "grad")
        _wrapf(l._Leader, "push_pull", "push_pull")
        _wrapf(s._ServerLoop, "apply_push", "apply")
        _wrapf(s._ServerLoop, "handle", "handle")
        _wrapf(s._ServerLoop, "send_weights", "send_weights")
        _wrapf(d.PSDistRuntime, "advance", "advance")
        _wrapf(d.PSDistRuntime, "_on_push", "on_push")
        for m in (l, s):
            _wrapf(m, "_send", "send")
        _wrapf(t, "_recv", "recv")
        _wrapf(l, "_recv", "recv")

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "distsgd.runtime.dist":
                sys.meta_path.remove(self)

                def later():
                    while "distsgd.runtime.dist" not in sys.modules or not hasattr(
                        sys.modules["distsgd.runtime.dist"], "build_runtime"
                    ):
                        time.sleep(0.01)
                    _install()

                threading.Thread(target=later, daemon=True).start()
            return None

    sys.meta_path.insert(0, _Finder())
