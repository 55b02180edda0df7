"""Whole fleets on one machine and test tools: local worker fleets, the WAN emulator."""
