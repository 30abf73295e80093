// Package composetest holds docker-compose.yml to a service's Config from
// inside that service's tests, where the Config type is visible.
package composetest

import (
	"testing"

	"github.com/kvmesh/kvmesh/deploy"
)

// CheckServiceEnv fails t unless docker-compose.yml under root runs
// program in at least one service and every such service's settings agree
// with cfg, a pointer to program's Config (see Compose.CheckServiceConfig:
// only variables cfg reads, required ones set, a loadable and valid
// configuration, the contract's HTTP port published and health-checked on
// /readyz, endpoints that lead to services it depends on). It returns the
// names of the services checked.
func CheckServiceEnv(t testing.TB, root, program string, cfg any) []string {
	t.Helper()
	c, err := deploy.LoadCompose(root)
	if err != nil {
		t.Fatal(err)
	}
	names := c.ProgramServices(program)
	if len(names) == 0 {
		t.Fatalf("%s: no service runs %s", deploy.ComposeFile, program)
	}
	for _, name := range names {
		for _, err := range c.CheckServiceConfig(name, cfg) {
			t.Errorf("%s: %v", deploy.ComposeFile, err)
		}
	}
	return names
}
