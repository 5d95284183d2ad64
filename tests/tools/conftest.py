import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))  # carry_size
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools", "peers"))  # compare, mapping, schema, ...: test_peers_*.py
