"""Read engines, one module each; every module registers one or more ``ReadEngine``."""
