"""Finding each other on the LAN: mDNS advertisements and browsing, the console's join service record."""
