"""Task environments: generators of problems with checkable answers, and their checkers."""
