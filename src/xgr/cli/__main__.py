"""``python -m xgr.cli``: the ``xgr`` command."""

from xgr.cli import main

main()
