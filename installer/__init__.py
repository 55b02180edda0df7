"""Packaging: the Debian packages and the Windows installer (see the installer issue).

The tray's own start-at-login registration is :mod:`agent.tray.autostart` (the product, at run
time); the packages reuse its names so their system-wide entry is the one the tray can mask.
Nothing in ``agent`` or ``console`` imports this package (an import-linter contract).
"""
