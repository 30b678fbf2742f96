// CoreDNS with the plugins the test node's Corefile uses (tests/integration/node.py).
//
// CoreDNS's own main (github.com/coredns/coredns, coredns.go) links every in-tree
// plugin, including the route53, azure and clouddns SDKs; building outside its
// repository with coremain plus the wanted plugins is the way its documentation gives
// for custom builds, and compiles a fraction of the code on a 2-core CI machine.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
