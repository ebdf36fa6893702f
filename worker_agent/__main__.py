import sys

from worker_agent.main import main

sys.exit(main(prog="python -m worker_agent"))
