"""The streaming engine: one pass over a dump feeds every metric group's mergeable state.

- :mod:`~grpo_cli.engine.config` — how a pass runs (:class:`~grpo_cli.engine.config.StreamConfig`) and the PPO
  options commands share (:class:`~grpo_cli.engine.config.PPOOptions`);
- :mod:`~grpo_cli.engine.group` — the :class:`~grpo_cli.engine.group.MetricGroup` base and the
  :class:`~grpo_cli.engine.group.Accumulator` of states;
- :mod:`~grpo_cli.engine.validate` — value checks between the reader and the groups (``--on-invalid``);
- :mod:`~grpo_cli.engine.stream`, :mod:`~grpo_cli.engine.runner`, :mod:`~grpo_cli.engine.parallel` — decoding
  ahead, metric threads, ``--workers`` processes and ``torchrun`` all-reduce;
- :mod:`~grpo_cli.engine.run` — :func:`~grpo_cli.engine.run.run`, the one entry every command uses.
"""
