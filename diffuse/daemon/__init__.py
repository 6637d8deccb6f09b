"""The owner's node in the background: one daemon per home (process.py) holding the client service,
and for a peer its blocks, warm between commands; its control socket's JSON-lines protocol
(protocol.py), the small client commands use without loading torch or py-libp2p (client.py), and
the systemd / launchd units that start it at login (units.py). docs/daemon.md says how."""

ACTIONS = {"start": "start it in the background and wait until it answers", "run": "run it in the foreground (what "
           "start and the units run)", "install": "write a systemd user unit (Linux) or launchd agent (macOS) that "
           "runs it with these options", "stop": "stop it (a peer drains first)", "status": "its state, contribution "
           "and what it serves", "logs": "the end of its log", "uninstall": "remove the unit or agent"}
