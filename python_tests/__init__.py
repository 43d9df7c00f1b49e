"""The test suite of moe_kernels: a package, so that each test module is named by its path
(python_tests.<folder>.test_<name>) and two folders may hold test files of the same name."""
