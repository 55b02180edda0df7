"""Packaging and autostart registration (see the installer issue)."""
