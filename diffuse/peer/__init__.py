"""Nodes that lend their machine to a swarm, as library calls: `diffuse join` (join.py), what the
data plane plugs into a peer's node (hooks.py), the draft heads it offers (heads.py), a sentinel
with its metrics (sentinel.py), a whole loopback swarm of processes (loopback.py, `demo`), and
how a node ends on a signal (signals.py)."""
