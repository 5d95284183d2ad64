"""Trainer backends behind :class:`megaforge.trainer.base.Trainer`; the configured one is built by
:meth:`megaforge.build.RunBuilder.trainer` (``trainer.backend``)."""
from __future__ import annotations
