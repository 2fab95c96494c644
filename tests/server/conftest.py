"""tests/server: the helper modules beside the tests (server_testing, fake_engine) are importable."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
