"""The CPU kernels, each family's module holding its ``@njit`` kernels and their
launchers side by side (private: the public functions are ``numbanorm.cpu``'s)."""
