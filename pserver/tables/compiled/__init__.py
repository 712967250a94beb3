"""The tables' numba kernels (compiled on first use, cached; ``nogil``): the id index's probe and insert
(:mod:`.index_kernels`) and a plain table's whole apply and lookup (:mod:`.row_kernels`). Each is tested
against the numpy definition it replaces; without numba the tables run on numpy."""
