"""The tuner (SPEC.md §3): Omnivore's optimizer and a performance model.

* :mod:`distsgd.tuner.perf_model` — time to accuracy = HE × SE, pure numerics (numpy);
* :mod:`distsgd.tuner.omnivore` — the search: cold start, pruning, HE rule, steady state,
  and the joint search over protocol family, layout and batch size;
* :mod:`distsgd.tuner.probes` — probes as short runs through the Trainer;
* :mod:`distsgd.tuner.tune` — ``distsgd tune``: phases, plan, prediction, verification;
* :mod:`distsgd.tuner.report` — ``report.md`` and its figures.
"""
