// Command pause holds a pod sandbox's namespaces: it sleeps until SIGINT or SIGTERM and, as PID 1 of
// the sandbox, reaps the children it inherits, like Kubernetes' own pause container.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is set at build time (-ldflags -X main.version=...).
var version = "unknown"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("lowtail pause", version)
		return
	}
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
