/* /usr/bin/{{ cookiecutter.app_name }}: start {{ cookiecutter.formal_name }} under the system Python.
 *
 * Why exec the interpreter rather than embed it: the app starts helper processes with
 * sys.executable (pip, for the demo's first run), which must be a real Python, and
 * Python's own startup (site, the standard library's paths) stays the one Debian ships.
 *
 * -I: the user's PYTHONPATH, PYTHONHOME and user site-packages cannot shadow the
 *     packaged libraries (the entry file puts those first on sys.path).
 * -X pycache_prefix: bytecode goes to the user's cache folder. The installed tree is
 *     read-only to users (without a cache Python would compile every module at every
 *     start), and a run as root must leave nothing there that removing the package
 *     would not remove. With no home to write to: -B, no bytecode written at all.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef PYTHON
#error "PYTHON (the interpreter's path) must be defined"
#endif
#ifndef ENTRY
#error "ENTRY (the app's entry file) must be defined"
#endif

#define CACHE_LEAF "/{{ cookiecutter.app_name }}/pycache"

/* "pycache_prefix=<XDG cache home>/<app>/pycache", or NULL where there is no home. */
static char *pycache_option(void) {
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    const char *base;
    const char *middle;
    if (xdg != NULL && xdg[0] == '/') { /* the spec ignores relative paths */
        base = xdg;
        middle = "";
    } else if (home != NULL && home[0] == '/') {
        base = home;
        middle = "/.cache";
    } else {
        return NULL;
    }
    size_t size = strlen("pycache_prefix=") + strlen(base) + strlen(middle) + strlen(CACHE_LEAF) + 1;
    char *option = malloc(size);
    if (option != NULL) {
        snprintf(option, size, "pycache_prefix=%s%s%s", base, middle, CACHE_LEAF);
    }
    return option;
}

int main(int argc, char *argv[]) {
    const int fixed = 5; /* interpreter, -I, -X prefix | -B -B, entry file */
    char **args = calloc((size_t)argc + fixed, sizeof(char *));
    if (args == NULL) {
        perror("{{ cookiecutter.app_name }}");
        return 71; /* EX_OSERR */
    }
    char *prefix = pycache_option();
    /* argv[0] is the interpreter's full path: Python finds sys.executable from it. */
    args[0] = PYTHON;
    args[1] = "-I";
    args[2] = prefix != NULL ? "-X" : "-B";
    args[3] = prefix != NULL ? prefix : "-B";
    args[4] = ENTRY;
    for (int i = 1; i < argc; i++) {
        args[fixed + i - 1] = argv[i];
    }
    args[argc + fixed - 1] = NULL;
    execv(PYTHON, args);
    fprintf(stderr, "{{ cookiecutter.app_name }}: cannot run %s: %s\n", PYTHON, strerror(errno));
    return 127;
}
