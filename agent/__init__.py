"""The tray agent: a Qt tray shell over a headless agent service (see the agent issue)."""
