"""Tools around the product: the network/compute emulator and `het-plugin profile`'s measuring.
"""
