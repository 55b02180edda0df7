"""The headless agent service: everything the tray agent does, without Qt.

``deskfleet agent --headless`` runs it alone (servers, tests); the Qt tray in ``agent.tray`` is a
thin shell over it. An import-linter contract keeps Qt out of this package.
"""
