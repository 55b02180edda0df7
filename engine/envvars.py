"""Names of the environment variables Deskfleet reads, in one place so they can be found and
documented. Values are read where they are used, once, into settings objects."""

KEYRING_DIR = "DESKFLEET_KEYRING_DIR"  # where FileKeyring keeps secrets when the OS has no keyring
