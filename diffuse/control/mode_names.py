"""The swarm modes' names and the swarm key's places, apart from control/modes.py (which imports
libp2p) so that the command line's parser can offer them without loading it."""

PRIVATE, PUBLIC = "private", "public"
MODES = (PRIVATE, PUBLIC)
KEY_ENV = "DIFFUSE_SWARM_KEY"
KEY_FILE = "swarm.key"
