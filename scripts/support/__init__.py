"""The pieces the scripts share, so that no script imports another: swarms of real processes
(swarm: bench_swarm.py's loopback peers; churn: chaos.py's swarm behind the API, its fault
injector and its users, the load generator; relayed_swarm: a private swarm whose peers sit behind
the delay relay), the delay relay as a child process (relay), server processes started and
waited for (servers), and the speculation benchmarks' prompts (prompts). A script imports them
as `from support.swarm import Peers`: scripts/ is sys.path[0] when a script runs, however it is
started. Modules here import nothing from the scripts."""
