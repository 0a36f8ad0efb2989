"""The GPU kernels, each family's module holding its ``@cuda.jit`` kernel factories
and their launchers side by side (private: the public functions are ``numbanorm.cuda``'s)."""
