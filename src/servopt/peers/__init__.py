"""The tools a user would use instead of servopt, measured side by side with servopt's pick (``servopt compare``).

Three independent axes, as optimum-benchmark has them: a **peer** (``base.Peer``, one file in ``builtin/`` each: its
environment, how it builds its answer for the run's model and data, what it says about what ran), a **scenario**
(``scenario.Scenario``, one file in ``scenarios/`` each: the workload and its figure), and one **runner**
(``runner``: every answer in a fresh process per round, the order flipped each round, same-run ratios with their
intervals). ``compare.compare`` puts them together for a run directory and writes ``compare.json``.
"""
