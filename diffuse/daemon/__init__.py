"""The owner's node in the background: one daemon per home (process.py) holding the client service,
and for a peer its blocks, warm between commands; its control socket's JSON-lines protocol
(protocol.py), the small client commands use without loading torch or py-libp2p (client.py), and
the systemd / launchd units that start it at login (units.py). docs/daemon.md says how."""
