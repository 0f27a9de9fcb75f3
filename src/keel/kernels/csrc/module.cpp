// keel.kernels._C: importing the module loads the library, whose static initialisers register the
// operators (torch.ops.keel.*); it has no Python functions of its own.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "keel's C++ CPU kernels (torch.ops.keel)", -1,
                                      nullptr};
  return PyModule_Create(&module);
}
