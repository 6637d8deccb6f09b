"""A peer that lends its machine to a swarm: `diffuse join` as a library call (join.py), what
the data plane plugs into its node (hooks.py), and the draft heads it offers (heads.py)."""
