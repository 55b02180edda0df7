"""Who is who in the fleet: the CA and its credentials, the keyring store, join tokens, peer checks."""
