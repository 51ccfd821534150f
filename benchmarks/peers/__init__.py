"""Peer runners of `kvforge bench`: standalone scripts, one per engine, each run
in its own process with the Python environment given for that engine."""
