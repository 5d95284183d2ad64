"""``python -m megaforge.rollout.server``: the embedded engine server (:mod:`megaforge.rollout.server.cli`)."""
from megaforge.rollout.server.cli import main

main()
