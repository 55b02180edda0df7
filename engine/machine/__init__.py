"""Facts about this PC: devices, memory and cores it can lend, its address and state directory."""
