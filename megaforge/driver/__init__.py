"""The RL step's drivers and the parts they are made of (used by :mod:`megaforge.loop`).

* :mod:`~megaforge.driver.common`: RunError, RunStopped, InputError, :func:`on_main`, :func:`timed`,
  the :class:`~megaforge.driver.common.Driver` interface (a leaf: imported by everything below and by
  the loop).
* :mod:`~megaforge.driver.steps`: :class:`StepParts`, the step primitives (rollout with dynamic
  sampling and the partial-rollout pool, train, push) and the advantages of a batch.
* :mod:`~megaforge.driver.sync` (:class:`SyncDriver`, one synchronous step) and
  :mod:`~megaforge.driver.offpolicy` (:class:`AsyncDriver`: overlap, partial rollouts, a sync
  interval): both implement :class:`~megaforge.driver.common.Driver`.

This package's ``__init__`` imports nothing, so that importing one module does not import the others.
"""
