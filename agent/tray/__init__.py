"""The Qt tray shell over :mod:`agent.service` (the only part of the agent that imports Qt)."""
