"""What tests and scripts share, so that neither keeps a copy and no script imports another:
`diffuse` children and servers started and waited for, free ports and the run's swarm key (procs),
loopback swarms of real processes (swarm: a sentinel and peers, the benchmarks' swarm, timed
greedy decoding; churn: chaos.py's swarm behind the API, its fault injector, its users, the load
generator; relayed_swarm: a private swarm whose peers sit behind the delay relay), the delay relay
as a child process (relay), the speculation benchmarks' prompts (prompts) and a step cost
fixed to a chosen network for the speculation planner (speculation). A script imports
them as `from support.swarm import Peers` (scripts/ is sys.path[0] when a script runs, however it
is started); tests/conftest.py puts scripts/ on the path for tests. Modules here import nothing
from the scripts or the tests."""
