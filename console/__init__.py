"""The admin console: thin Qt views over Qt-free fleet, placement and chat models."""
