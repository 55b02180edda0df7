"""The console's Qt-free services: the fleet it sees, the models it exports, placement inputs,
distribution of shards and bringing up the ring. The Qt pages in ``console`` are thin views over
these; an import-linter contract keeps Qt out of this package.
"""
