import sys

from sim_engine.main import main

sys.exit(main(prog="python -m sim_engine"))
