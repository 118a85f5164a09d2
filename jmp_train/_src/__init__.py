"""The implementation of jmp_train; the public modules are thin faces over it."""
