"""The tuner: Omnivore's optimizer, its performance model (docs/protocols.md §3), ``distsgd tune``.

* :mod:`distsgd.tuner.perf_model` — time to accuracy = HE × SE, pure numerics (numpy);
* :mod:`distsgd.tuner.omnivore` — the search: cold start, pruning, HE rule, steady state,
  and the joint search over protocol family, layout and batch size;
* :mod:`distsgd.tuner.probes` — probes and long runs as runs through the Trainer;
* :mod:`distsgd.tuner.budget` — the wall-clock budget's decisions;
* :mod:`distsgd.tuner.session` — the tune's phases, one method each, and their state;
* :mod:`distsgd.tuner.step_search` — where the plan steps its learning rate;
* :mod:`distsgd.tuner.plan` — the plan, its predicted time to accuracy, larger clusters;
* :mod:`distsgd.tuner.tune` — ``distsgd tune``'s entry points: tune, verification;
* :mod:`distsgd.tuner.online` — ``distsgd train --tune``: the search inside the run;
* :mod:`distsgd.tuner.report` — ``tune.json``, ``report.md`` and its figures.

Crossbow's auto-tuner of replicas per device is a training-time policy, not part of the
tune: :mod:`distsgd.replicas`.
"""
