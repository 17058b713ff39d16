"""The command line: ``undying run | status | inject | demo``."""
