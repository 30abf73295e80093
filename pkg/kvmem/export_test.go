package kvmem

// ReadWhileWriting is readWhileWriting, for the external tests (the Python
// writer's race in python_interop_test.go).
var ReadWhileWriting = readWhileWriting
