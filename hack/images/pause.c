/*
 * The sandbox ("pause") container of the test node's pods: PID 1 of the pod, holding its namespaces
 * open and doing nothing else. hack/build-images.sh compiles it statically into the pause image.
 *
 * As PID 1 it gets no default signal handling from the kernel, so it installs its own: SIGINT and
 * SIGTERM end it (exit 0, which is how the kubelet stops a sandbox), and SIGCHLD reaps whatever exits
 * (processes of the pod that end up reparented to it, e.g. with a shared PID namespace).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signum) {
	(void)signum;
	_exit(0);
}

static void reap(int signum) {
	int saved = errno; /* a handler must leave errno as it found it */
	(void)signum;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
	errno = saved;
}

static int on(int signum, void (*handler)(int)) {
	struct sigaction action;
	memset(&action, 0, sizeof(action));
	action.sa_handler = handler;
	action.sa_flags = signum == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : SA_RESTART;
	sigemptyset(&action.sa_mask);
	return sigaction(signum, &action, NULL);
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts("gpuwarden-pause");
		return 0;
	}
	if (getpid() != 1) {
		fputs("pause: warning: not PID 1\n", stderr);
	}
	if (on(SIGINT, stop) != 0 || on(SIGTERM, stop) != 0 || on(SIGCHLD, reap) != 0) {
		perror("pause: sigaction");
		return 1;
	}
	for (;;) {
		pause();
	}
}
