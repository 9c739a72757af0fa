"""Tuners: Omnivore's optimizer and its performance model (SPEC.md §3), and the
replicas-per-device auto-tuner (SPEC.md §4).

* :mod:`distsgd.tuner.perf_model` — time to accuracy = HE × SE, pure numerics (numpy);
* :mod:`distsgd.tuner.omnivore` — the search: cold start, pruning, HE rule, steady state,
  and the joint search over protocol family, layout and batch size;
* :mod:`distsgd.tuner.probes` — probes as short runs through the Trainer;
* :mod:`distsgd.tuner.tune` — ``distsgd tune``: phases, plan, prediction, verification;
* :mod:`distsgd.tuner.report` — ``report.md`` and its figures;
* :mod:`distsgd.tuner.replicas` — Crossbow's auto-tuner of replicas per device (SPEC.md §4).
"""
