"""A module that records being imported (tests/fault/test_security.py checks it never is)."""
import os

open(os.environ["MEGAFORGE_TEST_EVIL_MARKER"], "w").close()
