{{/* Names, labels and the pieces every Tandem pod shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name; pod names add "-prefill-N", so keep it short. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels of a component; call with (dict "root" $ "component" "router"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* How many ordinals of a pool the router is given: (dict "root" $ "pool" "prefill"). */}}
{{- define "tandem.poolSize" -}}
{{- $p := index .root.Values .pool }}
{{- if $p.keda.enabled }}{{ $p.keda.maxReplicas }}{{ else }}{{ $p.replicas }}{{ end }}
{{- end }}

{{/* The gRPC address of pod .i of a pool: (dict "root" $ "pool" "prefill" "i" 0). */}}
{{- define "tandem.nodeAddress" -}}
{{- $svc := printf "%s-%s" (include "tandem.fullname" .root) .pool }}
{{- printf "%s-%d.%s.%s.svc.%s:%d" $svc (int .i) $svc .root.Release.Namespace .root.Values.clusterDomain (int (index .root.Values .pool).grpcPort) }}
{{- end }}

{{/* The shared index's URL; empty without one. */}}
{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "tandem.fullname" .) }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* The Secret the env comes from; empty when neither given nor made. */}}
{{- define "tandem.secretName" -}}
{{- $s := .Values.secrets }}
{{- if $s.existingSecret }}
{{- $s.existingSecret }}
{{- else if or $s.apiKey $s.adminToken $s.clusterSecret }}
{{- include "tandem.fullname" . }}
{{- end }}
{{- end }}

{{/*
Secret env vars: (dict "root" $ "vars" (list "TANDEM_CLUSTER_SECRET")). An existing Secret
gives every var, optional (a missing key leaves its check off); a made one gives only the
values set.
*/}}
{{- define "tandem.secretEnv" -}}
{{- $s := .root.Values.secrets }}
{{- $name := include "tandem.secretName" .root }}
{{- $keys := dict "TANDEM_API_KEY" "api-key" "TANDEM_ADMIN_TOKEN" "admin-token" "TANDEM_CLUSTER_SECRET" "cluster-secret" }}
{{- $given := dict "TANDEM_API_KEY" $s.apiKey "TANDEM_ADMIN_TOKEN" $s.adminToken "TANDEM_CLUSTER_SECRET" $s.clusterSecret }}
{{- range .vars }}
{{- if or $s.existingSecret (index $given .) }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ index $keys . }}
      {{- if $s.existingSecret }}
      optional: true
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Restart pods when the Secret the chart makes changes. */}}
{{- define "tandem.secretChecksum" -}}
{{- if and (not .Values.secrets.existingSecret) (include "tandem.secretName" .) }}
checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- end }}

{{/* The model flags every Tandem process takes. */}}
{{- define "tandem.modelArgs" -}}
- --model
- {{ .Values.model.name | quote }}
- --load-format
- {{ .Values.model.loadFormat }}
{{- end }}

{{/* /tmp (HOME: caches) and the model, as pod volumes. */}}
{{- define "tandem.volumes" -}}
- name: tmp
  emptyDir: {}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source hostPath" $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "initContainer" }}
- name: model
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* HOME on the writable /tmp: the root filesystem is read-only. */}}
{{- define "tandem.homeEnv" -}}
- name: HOME
  value: /tmp
{{- end }}

{{- define "tandem.initContainers" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "initContainer" }}
initContainers:
  - name: fetch-model
    image: {{ required "model.initContainer.image is required with model.source initContainer" $m.initContainer.image }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      {{- required "model.initContainer.command is required with model.source initContainer" $m.initContainer.command | toYaml | nindent 6 }}
    {{- with $m.initContainer.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: model
        mountPath: {{ $m.mountPath }}
{{- end }}
{{- end }}

{{/* Pod spec fields shared by the router and the nodes. */}}
{{- define "tandem.podCommon" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- include "tandem.initContainers" . }}
{{- end }}

{{/* Pods of this release by component: (dict "root" $ "components" (list "router")). */}}
{{- define "tandem.peers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "tandem.name" .root }}
      app.kubernetes.io/instance: {{ .root.Release.Name }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: [{{ join ", " .components }}]
{{- end }}
