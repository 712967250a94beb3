"""The pytest suite (a package, so its helpers import as ``tests.helpers``)."""
