package main

import (
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if err := testenv.RemoveBinaries(); err != nil {
		fmt.Fprintln(os.Stderr, "remove test binaries:", err)
	}
	http.DefaultClient.CloseIdleConnections()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Engines of the CLI stack: one with a gpuworker from the start, one whose
// worker starts mid-test (its saves are dead-lettered put_failed until
// then), and one that only has request trackers.
const (
	cliEngine     = "cli-e1"
	cliLateEngine = "cli-late"
	cliReqEngine  = "cli-req"
)

// TestAdminCommands runs the admin commands against the real services, as
// subprocesses, started once for all of them: the subtests run in order and
// build on each other (the late engine's worker starts in the middle).
func TestAdminCommands(t *testing.T) {
	t.Setenv("KVMESH_ADMIN_TOKEN", "") // the tests pass --token explicitly
	s := newCLIStack(t, cliEngine)
	ids := seedDeadLetters(t, s)
	seedRequests(t, s)

	t.Run("dlq list", func(t *testing.T) { testDLQList(t, s, ids) })
	t.Run("dlq show", func(t *testing.T) { testDLQShow(t, s, ids) })
	t.Run("token errors", func(t *testing.T) { testTokenErrors(t, s, ids) })
	t.Run("dlq replay invalid", func(t *testing.T) { testReplayInvalid(t, s, ids) })
	t.Run("dlq replay by reason", func(t *testing.T) { testReplayByReason(t, s, ids) })
	t.Run("requests", func(t *testing.T) { testRequests(t, s) })
	t.Run("workers", func(t *testing.T) { testWorkers(t, s) })
	t.Run("status", func(t *testing.T) { testStatus(t, s) })
}

func TestURLListFlag(t *testing.T) {
	l := urlList{urls: []string{"http://default:8084"}}
	for _, v := range []string{"http://a:1/, http://b:2", "http://c:3"} {
		if err := l.Set(v); err != nil {
			t.Fatal(err)
		}
	}
	if got := l.String(); got != "http://a:1,http://b:2,http://c:3" {
		t.Fatalf("urls %q: the default must go and every occurrence count", got)
	}
}

func TestParseFlagsInterspersed(t *testing.T) {
	quiet(t)
	for _, args := range [][]string{
		{"--token", "x", "1", "2", "--dry-run"},
		{"1", "--dry-run", "2", "--token=x"},
	} {
		fs := newTestFlagSet()
		dry := fs.Bool("dry-run", false, "")
		token := fs.String("token", "", "")
		rest, err := parseFlags(fs, args)
		if err != nil || strings.Join(rest, ",") != "1,2" || !*dry || *token != "x" {
			t.Errorf("%q: rest %q dry %v token %q err %v", args, rest, *dry, *token, err)
		}
	}
}

func TestAdminCommandUsageErrors(t *testing.T) {
	quiet(t)
	for _, args := range [][]string{
		{"dlq"}, {"dlq", "purge"}, {"dlq", "show"}, {"dlq", "show", "1", "2"},
		{"dlq", "replay"}, {"dlq", "replay", "1", "--reason", "x"}, {"dlq", "replay", "abc"},
		{"dlq", "list", "extra"}, {"dlq", "list", "--nope"},
		{"requests"}, {"requests", "show", "only-engine"}, {"workers", "x"}, {"status", "x"},
	} {
		if code := exitCode(dispatch(t.Context(), args)); code != 2 {
			t.Errorf("kvmesh %q: exit %d, want 2 (usage)", args, code)
		}
	}
}

func newTestFlagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}
