"""The fleet service (``deskfleet fleet``), headless: the fleet it sees, the models it exports,
placement inputs, distribution of shards, bringing up and failing over rings, and the admin API
it serves. The console's Qt views (``console.qt``) are its clients over that API
(``console.fleet_api``) and never import this package; an import-linter contract keeps Qt out.
"""
