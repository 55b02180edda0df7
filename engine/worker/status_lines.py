"""What a stage worker prints on stdout for the agent that supervises it.

The agent reads these lines to know the worker is ready, how it is doing, and that a peer-policy
update from stdin is in force; anything else on stdout is log output.
"""

READY_PREFIX = "deskfleet worker: stage"  # once, when the listener is up
STATS_PREFIX = "deskfleet-stats "  # then every report interval
PEERS_PREFIX = "deskfleet-peers"  # a peer-policy update read from stdin is in force
